"""kvshare engine: a torch-free core (pool, cache, scheduler) and a torch runtime."""
