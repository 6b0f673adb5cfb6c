"""Running steps on a model: the KV store with a length per sequence, and the packing of many
sequences' steps into one forward."""
