"""RL post-training of flow-matching VLAs on the rollout engine and the Trainer (`roboscale rl`)."""
