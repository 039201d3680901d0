"""remat: trade compute for memory in PyTorch training."""
