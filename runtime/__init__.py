"""ember.runtime."""
