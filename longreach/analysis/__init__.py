"""Why a model's effective context falls short: dispersion, position frequency, cost."""
