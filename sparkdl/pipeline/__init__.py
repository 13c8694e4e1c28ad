"""Model parallelism: a model cut into pipeline stages, one barrier task per stage and replica."""
