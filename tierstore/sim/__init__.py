"""Cache simulation: exact policies, the tier itself, miss-ratio curves and the benchmark."""
