"""The audit log: every admin change, who made it, and the resource before and after."""
