"""Device-side DDTree tree core: build, layout, walk. No host synchronisation anywhere in this package."""
