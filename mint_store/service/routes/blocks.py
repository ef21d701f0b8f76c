"""``GET /v1/blobs/{id}/blocks``: the block digests of a row (:mod:`mint_store.format.blocks`)."""

from __future__ import annotations

from aiohttp import web

from ...format.names import check_content_id
from ...read.vread import row_block_digests
from ..state import principal_of, state_of

routes = web.RouteTableDef()


@routes.get("/v1/blobs/{content_id}/blocks", allow_head=False)
async def blocks(request: web.Request) -> web.Response:
    """The block digests of a row (16 bytes per block, :mod:`mint_store.format.blocks`), checked here
    against the anchor its commit recorded, with their grid in ``X-Mint-Grid: blocks,min_block``;
    ``204`` for a row published without them."""
    st = state_of(request)
    ref = f"sha:{check_content_id(request.match_info['content_id'])}"
    loc = await st.resolver.resolve(ref, principal_of(request).owner_filter())
    got = await st.run(row_block_digests, st.store, loc)
    if got is None:
        return web.Response(status=204)
    return web.Response(body=got.digests, content_type="application/octet-stream",
                        headers={"X-Mint-Content-Id": loc.content_id, "X-Mint-Layout-Id": loc.layout_id,
                                 "X-Mint-Grid": f"{got.grid.blocks},{got.grid.min_block}",
                                 "Cache-Control": "private, max-age=31536000, immutable"})
