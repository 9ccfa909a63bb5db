"""GR00T N1.5: config, per-sample transform, Eagle VLM, flow-matching action head and the policy."""
