"""Adapters to engines users already run: Ray Data (`ray_data.SartorPredictor`, offline over a
cluster's GPUs) and Ray Serve (`ray_serve`, online). Ray is optional (`pip install sartor[ray]`):
nothing here imports it until one of these modules is used."""
