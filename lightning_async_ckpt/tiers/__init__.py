"""Two tiers and peer replicas: where a committed generation goes next (promotion, replicas, cross-tier resume)."""
