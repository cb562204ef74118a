"""moe-echo components: MoE layer pieces (moe_echo), parallelism (parallel), training glue (train)."""
