"""The inference engine; built by the engine issue."""
