"""Runtime machinery around the models: fused losses, gradient-accumulation fusion, fp8 layers,
attention-kernel checks, CUDA graphs. Applied from outside (parallel/, training/); models never import it."""
