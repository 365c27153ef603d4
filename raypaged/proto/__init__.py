"""Generated gRPC stubs of the raypaged API (sources in protos/; scripts/gen_protos.sh)."""
