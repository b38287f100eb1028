"""zhuzi's prefix-cache pins: /v1/cache/pins keeps a prefix's KV pages in the cache under a name (every
replica holds it, so whichever a chat lands on finds its prefix cached), lists the pins and deletes one."""
