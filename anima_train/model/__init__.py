"""The model side: load a converted Anima repo, key maps, conversion, quantisation, prompt encoding, tiny models."""
