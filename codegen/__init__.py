"""ember.codegen."""
