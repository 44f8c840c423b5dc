"""The dataset side: scan folders, bucket, caption, crop, cache latents, serve batches."""
