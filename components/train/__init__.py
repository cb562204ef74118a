"""Training glue shared by the recipes: config, data, checkpoints, metrics."""
