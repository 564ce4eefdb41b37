"""Plans: rate limits, budgets and quotas that organisations point at."""
