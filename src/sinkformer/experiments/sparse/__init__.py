"""The Sparse Sinkhorn Attention paper's experiments (Tay et al. 2020)."""
