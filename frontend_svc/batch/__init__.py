"""The online Batch API (`/v1/files`, `/v1/batches`): files and batch state in Redis, and a
runner inside every frontend that claims batches with a lease and runs their lines as ordinary
requests (docs/internals.md, "Batch API")."""
