"""ember.passes."""
