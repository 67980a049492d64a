"""The speculation core: proposal and tree types, verification, sampling, the controller, proposers and the engine step."""
