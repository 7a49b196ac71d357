"""One engine step: the engine loop (the BatchOp lifecycle), its batch, the model runner, CUDA graphs, the KV cache's memory, and the weights the runners share."""
