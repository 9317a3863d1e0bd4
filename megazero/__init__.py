"""megazero: 3D-parallel GPT-2 training (tensor, pipeline, ZeRO data parallelism)."""
