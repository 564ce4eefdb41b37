"""The price book: per-model token prices and per-GPU-type hourly prices, in versions."""
