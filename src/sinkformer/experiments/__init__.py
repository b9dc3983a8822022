"""One module per paper experiment: its configuration, its run and its report."""
