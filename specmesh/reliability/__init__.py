"""The reliability suite (`specmesh chaos`): bounded, loopback-only checks of a real mesh.

Parts (`--parts`): fuzz (generated requests against the public and the internal services; every
answer must be a documented status), limits (each size limit at and just past its edge),
security (mTLS on the internal ports, admin keys, no text in logs or spans, bind addresses).
Each part writes a JSON result; `specmesh chaos --docs` puts the tables in docs/reliability.md.
"""
