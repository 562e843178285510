-- Q6, average selling price by seller: each closed auction's winning price averaged with the
-- seller's 9 auctions closed before it.
WITH winning AS (
    SELECT A.id, A.seller, A.expires, max(B.price) AS final
    FROM auction AS A JOIN bid AS B ON A.id = B.auction
    WHERE B.event_time BETWEEN A.event_time AND A.expires AND B.price >= A.reserve
    GROUP BY A.id, A.seller, A.expires
)
SELECT seller, id AS auction, avg(final) OVER (
    PARTITION BY seller ORDER BY expires, id ROWS BETWEEN 9 PRECEDING AND CURRENT ROW
) AS price
FROM winning
