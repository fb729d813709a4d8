"""The federation core: messages, payloads, the strategy protocol, the client trainer, the runner."""
