"""Model definitions dattri-ds trains and rebuilds (heavy frameworks imported lazily)."""
