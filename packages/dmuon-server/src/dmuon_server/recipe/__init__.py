"""What the server knows of the recipe: the review of a spec, admission (will it fit), model
directories, spec fingerprints."""
