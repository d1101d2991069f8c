"""Runtime: packed checkpoints as torch modules, transformers loading, generation and tensor-parallel slices."""
