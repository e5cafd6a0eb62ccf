"""ember.frontends."""
