"""How instances hand work to each other: the KV protocols and the typed parameters of each hand-off."""
