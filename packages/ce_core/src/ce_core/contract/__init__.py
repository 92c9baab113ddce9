"""The backend contract and what surrounds it: the Backend base class and its types, the registry,
tile sizes, errors and compile results."""
