"""The producer -> trainer contract: manifest schema, parsing, store validation and its CLI."""
