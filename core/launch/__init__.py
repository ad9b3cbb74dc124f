"""What starts, wires and supervises fleet's processes: the node plan and its memory plan,
spawn and handshake, the engine-core, worker and coordinator processes' mains, the executors,
the job store and replica restarts. Above the workers and the engine's core (docs/architecture.md)."""
