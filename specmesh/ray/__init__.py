"""`specmesh ray`: the mesh's services as Ray actors (optional extra: pip install 'specmesh[ray]')."""
