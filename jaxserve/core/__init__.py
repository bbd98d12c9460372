"""What runs next, in plain Python with no jax: sequences, the block pool, the KV manager
(prefix cache, block tables) and the scheduler that turns waiting and running sequences into one
step's plan."""
