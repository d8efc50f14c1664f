"""Serving: the API's gateway to the leader rank, and the supervisor that keeps an instance up."""
