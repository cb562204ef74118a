"""MoE layer components: router, dispatcher backends, grouped experts, layer, torchtitan swap-in."""
