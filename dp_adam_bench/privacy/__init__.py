"""Privacy core: noise-correlating strategies, streaming noise mechanisms, accounting, lecture mechanisms."""
