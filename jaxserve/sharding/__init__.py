"""Device meshes (`make_mesh`) and the logical-axis -> mesh-axis rules (`RULES`)."""
