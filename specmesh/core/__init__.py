"""Pure core: sampling, rejection sampling, proposers, stats. No grpc/redis/ray imports here."""
