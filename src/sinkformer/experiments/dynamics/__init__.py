"""Transformers as interacting particles: the experiments of Castin et al., Agarwal et al. and Sinkformers §5."""
