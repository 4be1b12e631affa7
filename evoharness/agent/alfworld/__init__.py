"""ALFWorld on the real engine: offline game generation, the game loader and the engine wrappers."""
