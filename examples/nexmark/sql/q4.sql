-- Q4, average closing price per category: the highest bid at or above the reserve of each
-- auction while it is open, averaged over the auctions of each category (an auction without
-- such a bid did not sell: it is not counted).
WITH winning AS (
    SELECT A.id, A.category, max(B.price) AS final
    FROM auction AS A JOIN bid AS B ON A.id = B.auction
    WHERE B.event_time BETWEEN A.event_time AND A.expires AND B.price >= A.reserve
    GROUP BY A.id, A.category
)
SELECT category, avg(final) AS price FROM winning GROUP BY category
