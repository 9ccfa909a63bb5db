"""pi0.5: config, token layout, per-sample transform, model, and LeRobot checkpoint names."""
