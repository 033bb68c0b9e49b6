"""Miles integration: the shapes of Miles this plugin binds to, and checks made before training."""
