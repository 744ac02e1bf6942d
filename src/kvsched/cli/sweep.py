"""`kvsched sweep`: a grid of policies x parameters x rates x seeds, in parallel, resumable."""
