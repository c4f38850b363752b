"""OpenAI-compatible HTTP server over the engine (`cedlm serve`); see cedlm.server.app."""
