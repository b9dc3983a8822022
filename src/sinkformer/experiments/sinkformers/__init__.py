"""The Sinkformers paper's experiments (Sander et al. 2022): every one compares a Transformer with its Sinkformer."""
